"""TokenView: a sequence's prompt, output and drafts read as one list without joining them
(a step's work slices the tokens it computes; joining copied every sequence's whole context
on every step). Checked against the joined list on every kind of index."""

import random

import pytest

from services.engine.core.sequence import TokenView


def test_every_slice_and_index_reads_what_the_joined_list_holds():
    rng = random.Random(0)
    for _ in range(500):
        parts = [[rng.randrange(100) for _ in range(rng.randrange(6))] for _ in range(3)]
        view, full = TokenView(*parts), parts[0] + parts[1] + parts[2]
        assert len(view) == len(full)
        assert view.list() == full
        for _ in range(10):
            a, b = rng.randint(-9, 20), rng.randint(-9, 20)
            assert view[a:b] == full[a:b]
            assert view[a:] == full[a:] and view[:b] == full[:b]
            assert view[a:b:2] == full[a:b:2]
        for i in range(-len(full), len(full)):
            assert view[i] == full[i]
        with pytest.raises(IndexError):
            view[len(full)]


def test_the_view_follows_its_lists():
    """A work is built and read within one step; still, the view reads the lists as they
    are, not a copy taken when it was made."""
    prompt, output = [1, 2, 3], [4]
    view = TokenView(prompt, output, ())
    output.append(5)
    assert view[3:5] == [4, 5] and len(view) == 5
