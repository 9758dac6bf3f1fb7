"""`python -m magnitude.operator`: run the operator (same as `magnitude operator`)."""

from magnitude.operator.main import main

raise SystemExit(main())
