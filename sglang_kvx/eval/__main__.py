from sglang_kvx.eval.runner import main

raise SystemExit(main())
