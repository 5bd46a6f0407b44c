/* union_attention.c's float64 path (included there, after Part, Table and expand_row): the
   same math as part_f32 in float64 with plain loops, one key at a time, for the engine's
   float64 exactness tests. A separate file only to keep union_attention.c short. */

/* One key row v for query row qt, float64, plain loops: the reference-grade path. */
static void feed_f64(double *acc, double *mx, double *den, const double *qt, int64_t heads,
                     int64_t d, double scale, const double *v)
{
    for (int64_t h = 0; h < heads; h++) {
        double dot = 0, *o = acc + h * d;
        for (int64_t i = 0; i < d; i++)
            dot += qt[h * d + i] * v[i];
        double s = dot * scale;
        if (s > mx[h]) {
            double shrink = exp(mx[h] - s);
            den[h] *= shrink;
            for (int64_t i = 0; i < d; i++)
                o[i] *= shrink;
            mx[h] = s;
        }
        double w = exp(s - mx[h]);
        den[h] += w;
        for (int64_t i = 0; i < d; i++)
            o[i] += w * v[i];
    }
}

static void part_f64(const Part *a)
{
    const int64_t heads = a->heads, d = a->d;
    float v32[MAX_D];
    double v[MAX_D];
    double *acc = malloc(sizeof(double) * (size_t)(heads * d + 2 * heads));
    if (!acc)
        abort();
    double *mx = acc + heads * d, *den = mx + heads;
    for (int64_t t = a->first; t < a->last; t++) {
        const double *qt = (const double *)a->q + t * heads * d;
        for (int64_t h = 0; h < heads; h++) {
            mx[h] = -INFINITY;
            den[h] = 0;
        }
        memset(acc, 0, sizeof(double) * (size_t)(heads * d));
        for (int64_t r = 0; a->codes && r < a->ring; r++) {
            if (!a->ring_ok[t * a->ring + r])
                continue;
            expand_row(a->codes + a->slots[t] * a->slot_stride + r * a->row_bytes, (int)d, v32);
            for (int64_t i = 0; i < d; i++)
                v[i] = v32[i];
            feed_f64(acc, mx, den, qt, heads, d, a->scale, v);
        }
        for (int g = 0; g < 2; g++)
        for (int64_t k = 0; a->tab[g].rows && k < a->tab[g].picks; k++) {
            const Table *tb = &a->tab[g];
            if (!tb->ok[t * tb->picks + k])
                continue;
            const float *row = tb->rows + tb->idx[t * tb->picks + k] * tb->stride;
            for (int64_t i = 0; i < d; i++)
                v[i] = row[i];
            feed_f64(acc, mx, den, qt, heads, d, a->scale, v);
        }
        for (int64_t h = 0; h < heads; h++) {
            double *o = (double *)a->out + (t * heads + h) * d;
            double m = mx[h], total = den[h], keep = 1;
            if (a->sink) {
                double s = ((const double *)a->sink)[h], top = s > m ? s : m;
                keep = total > 0 ? exp(m - top) : 0;
                total = total * keep + exp(s - top);
                m = top;
            }
            double inv = total > 0 ? keep / total : 0;
            for (int64_t i = 0; i < d; i++)
                o[i] = acc[h * d + i] * inv;
            ((double *)a->lse)[t * heads + h] = total > 0 ? m + log(total) : -INFINITY;
        }
    }
    free(acc);
}
