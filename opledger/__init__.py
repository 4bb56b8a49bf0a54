"""opledger: the application (CLI, local stack launcher, wiring of the components)."""
