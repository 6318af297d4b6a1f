"""What the tests share: the tolerance table, the float64 references, the CPU schedule, HLO
readers, training-run helpers, the TPU programs, the small model of the input checks and the
set-up of every test process."""
