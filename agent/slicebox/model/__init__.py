"""Values and wire models: names, limits, specs, labels, errors, config, the API bodies.

Pure and dependency-free within slicebox: every other layer imports from here, this layer
imports from none of them."""
