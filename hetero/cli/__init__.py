"""The `hetero` command: one module per subcommand, registered in main.py. Parsing and rendering only."""
