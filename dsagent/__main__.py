"""`python -m dsagent`: the same command line as the `dsagent` script (`dsagent.cli`)."""
from dsagent.cli import main

main()
