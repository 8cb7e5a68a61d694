"""Control: commands for a running job (rollbacks, power caps) and the API that serves them."""
