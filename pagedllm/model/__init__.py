"""The model side of a step: a plan's flat batch through the Llama-family decoder over the paged cache, sampled."""
