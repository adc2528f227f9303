import sys

from meshlearn.entry.cli import main

sys.exit(main())
