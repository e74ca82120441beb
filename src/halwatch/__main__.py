from halwatch.cli import main

raise SystemExit(main())
