"""``python -m skrull_ext.planner``: the same as the ``skrull-plan`` command."""
import sys

from skrull_ext.planner.cli import main

sys.exit(main())
