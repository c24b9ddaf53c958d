"""`raylm bench ...`: one module per benchmark command; each prints figures (never a timed assertion in a test)
and runs a peer side by side where one runs here."""
