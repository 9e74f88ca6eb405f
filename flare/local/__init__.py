"""The local stack of `flare up` and the tests: the tansu broker launcher, process supervision."""
