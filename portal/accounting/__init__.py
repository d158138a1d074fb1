"""Accounting: who is charged for which GPU-seconds (and energy), per day."""
