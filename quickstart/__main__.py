"""`python -m bam_quickstart` (and `python -m quickstart` in a checkout's root) is
`bam-quickstart`."""

from bam_quickstart.run import main

raise SystemExit(main())
