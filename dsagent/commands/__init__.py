"""Sub-command groups of the `dsagent` CLI, each a `typer.Typer` mounted by `dsagent.cli`."""
