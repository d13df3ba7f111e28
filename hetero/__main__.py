from hetero.cli.main import main

raise SystemExit(main())
