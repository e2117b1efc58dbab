"""The experiment as the hosts get it: its layout and checks, archive, lock and environment."""
