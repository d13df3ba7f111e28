"""Enforcing: carry out a Plan on an unmodified training script. Never decides placement."""
