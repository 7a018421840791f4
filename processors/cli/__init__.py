"""`settle`, the command line: parses flags and calls the layers below. May import any layer; nothing imports it."""
