import sys

from gdn_jax.sweep.cli import main

sys.exit(main())
