"""fsm package."""
