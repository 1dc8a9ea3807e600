"""dsagent package."""
