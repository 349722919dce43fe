"""(rule family under construction; filled in by this issue)."""
