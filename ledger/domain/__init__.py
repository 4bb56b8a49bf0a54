"""The pure core: states, transition tables, events and the fold. No I/O, no clock, no randomness
that is not passed in; imports the standard library and pydantic only."""
