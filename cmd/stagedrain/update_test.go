package main

import "flag"

// -update rewrites the golden files of the module's testdata/ (the relay
// package's golden tests write them). This package has none, but
// go test ./... -update passes the flag to every package's test binary,
// which must define it.
var _ = flag.Bool("update", false, "rewrite golden files (none in this package)")
