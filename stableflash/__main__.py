from stableflash.cli import main

raise SystemExit(main())
