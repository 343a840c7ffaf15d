from quickstart.run import main

raise SystemExit(main())
