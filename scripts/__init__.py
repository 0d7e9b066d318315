"""The repository's one-off scripts: record builders and checks the package does not ship (README.md lists them)."""
