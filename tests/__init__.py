"""herald_torchrec's tests, one folder per subpackage (schedule/, distributed/, data/, models/, app/, benchmarks/), the
scenarios a user runs end to end in scenarios/, shared harnesses in helpers/. A package so that every test module has
one dotted name (tests.distributed.test_mixed): the multi-rank workers are named by it in their subprocesses."""
