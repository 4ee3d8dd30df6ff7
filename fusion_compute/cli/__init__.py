"""The `fusion` command: the parser and its subcommands (generate, plan, worker, keys; serve, chat,
audit, bench register themselves), and the flags every subcommand shares.

Top of the tree: only `__main__` imports cli.main; other packages may import cli.options only."""
