package main

import (
	"fmt"
	"io"
	"runtime/debug"
)

// version is set at build time with -ldflags "-X main.version=v1.2.3";
// otherwise it is the module version recorded in the binary, or "devel".
var version = ""

func versionString() string {
	if version != "" {
		return version
	}
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
		return bi.Main.Version
	}
	return "devel"
}

func versionCmd(args []string, stdout io.Writer) error {
	f := newFlagSet("version", "Print stagedrain's version.")
	if err := f.parse(args, stdout); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "stagedrain %s\n", versionString())
	return nil
}
