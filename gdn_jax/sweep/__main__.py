import sys

from gdn_jax.sweep.cli import main
from gdn_jax.training.entry import interrupts_delivered

with interrupts_delivered():  # a Ctrl-C is never lost in a garbage-collection callback
    status = main()
sys.exit(status)
