"""The privacy guarantee: accounting, noise, secret randomness, Poisson sampling, what is released."""
