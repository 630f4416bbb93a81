"""`python -m lemix.cli`: the same as the `lemix` command."""

import sys

from lemix.cli.main import main

sys.exit(main())
