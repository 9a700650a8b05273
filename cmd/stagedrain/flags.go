package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
)

var errHelp = errors.New("help shown")

// flagSet is a command's flags, each bound to an environment variable.
type flagSet struct {
	fs   *flag.FlagSet
	cmd  string
	envs map[string]string // flag name -> environment variable
	desc string
}

func newFlagSet(cmd, desc string) *flagSet {
	fs := flag.NewFlagSet(cmd, flag.ContinueOnError)
	fs.SetOutput(io.Discard) // errors are reported once, by run
	return &flagSet{fs: fs, cmd: cmd, envs: make(map[string]string), desc: desc}
}

// env records that flag name takes its value from variable env when it is
// not given on the command line.
func (f *flagSet) env(name, env string) {
	f.envs[name] = env
	fl := f.fs.Lookup(name)
	fl.Usage += " [$" + env + "]"
}

// parse parses args, then fills each flag not given from its environment
// variable. --help prints the flags to stdout and returns errHelp.
func (f *flagSet) parse(args []string, stdout io.Writer) error {
	if err := f.fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			f.printHelp(stdout)
			return errHelp
		}
		return usagef("%s: %s (see 'stagedrain %s --help')", f.cmd, err, f.cmd)
	}
	if f.fs.NArg() > 0 {
		return usagef("%s: unexpected argument %q (see 'stagedrain %s --help')", f.cmd, f.fs.Arg(0), f.cmd)
	}
	given := make(map[string]bool)
	f.fs.Visit(func(fl *flag.Flag) { given[fl.Name] = true })
	var err error
	f.fs.VisitAll(func(fl *flag.Flag) {
		env, ok := f.envs[fl.Name]
		if err != nil || given[fl.Name] || !ok {
			return
		}
		v, set := os.LookupEnv(env)
		if !set || v == "" {
			return
		}
		if e := fl.Value.Set(v); e != nil {
			// Never echo the value: it may be a URL with a password.
			err = usagef("%s: invalid value in $%s for --%s: %s", f.cmd, env, fl.Name, e)
		}
	})
	return err
}

func (f *flagSet) printHelp(w io.Writer) {
	fmt.Fprintf(w, "Usage: stagedrain %s [flags]\n\n%s\n\nFlags:\n", f.cmd, f.desc)
	f.fs.VisitAll(func(fl *flag.Flag) {
		name, usage := flag.UnquoteUsage(fl)
		line := "  --" + fl.Name
		if name != "" {
			line += " " + name
		}
		fmt.Fprintln(w, line)
		def := ""
		if fl.DefValue != "" && fl.DefValue != "false" && fl.DefValue != "0" {
			def = " (default " + fl.DefValue + ")"
		}
		fmt.Fprintf(w, "        %s%s\n", strings.ReplaceAll(usage, "\n", "\n        "), def)
	})
}

// flagFor names a flag in a message: --name.
func flagFor(name string) string { return "--" + name }
