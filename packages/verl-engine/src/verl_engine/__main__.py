"""``python -m verl_engine`` (and ``torchrun ... -m verl_engine``) runs the CLI."""

import sys

from verl_engine.apps.cli import main

sys.exit(main())
