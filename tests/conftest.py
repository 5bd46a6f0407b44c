import os

# Tests run single-threaded torch: the CI machine has 2 cores and several
# service processes share them.
os.environ.setdefault("OMP_NUM_THREADS", "1")
