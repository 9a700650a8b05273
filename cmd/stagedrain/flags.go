package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"regexp"
	"slices"
	"strings"
)

var errHelp = errors.New("help shown")

// flagSet is a command's flags, each bound to an environment variable.
type flagSet struct {
	fs       *flag.FlagSet
	cmd      string
	desc     string
	envs     map[string]string // flag name -> environment variable
	fromEnv  map[string]bool   // flags whose value came from the environment
	nonEmpty map[string]bool   // string flags that may not be set to ""
	operands string            // what the command takes after its flags ("ID..."), or "" for nothing
	args     []string          // the operands given, in order, after parse
}

func newFlagSet(cmd, desc string) *flagSet {
	fs := flag.NewFlagSet(cmd, flag.ContinueOnError)
	fs.SetOutput(io.Discard) // errors are reported once, by run
	return &flagSet{fs: fs, cmd: cmd, desc: desc,
		envs: make(map[string]string), fromEnv: make(map[string]bool), nonEmpty: make(map[string]bool)}
}

// env records that flag name takes its value from variable env when it is
// not given on the command line.
func (f *flagSet) env(name, env string) {
	f.envs[name] = env
	fl := f.fs.Lookup(name)
	fl.Usage += " [$" + env + "]"
}

// required marks string flags that may not be set to "" (which would
// otherwise quietly mean the default).
func (f *flagSet) required(names ...string) {
	for _, n := range names {
		f.nonEmpty[n] = true
	}
}

// source names where flag name's value came from, for a message:
// "--name", or "$ENV (--name)" when it came from the environment.
func (f *flagSet) source(name string) string {
	if f.fromEnv[name] {
		return "$" + f.envs[name] + " (--" + name + ")"
	}
	return "--" + name
}

// singleDash matches the "-name" the flag package writes in its errors.
var singleDash = regexp.MustCompile(`(^|[\s:])-([a-zA-Z])`)

// parse parses args, then fills each flag not given from its environment
// variable. --help prints the flags to stdout and returns errHelp.
func (f *flagSet) parse(args []string, stdout io.Writer) error {
	// Operands and flags may mix ("retry 4 5 --database-url ..."): parse
	// again after each operand.
	for rest := args; ; {
		if err := f.fs.Parse(rest); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				f.printHelp(stdout)
				return errHelp
			}
			msg := singleDash.ReplaceAllString(err.Error(), "$1--$2")
			return usagef("%s: %s (see 'stagedrain %s --help')", f.cmd, msg, f.cmd)
		}
		if f.fs.NArg() == 0 {
			break
		}
		if f.operands == "" {
			return usagef("%s: unexpected argument %q (see 'stagedrain %s --help')", f.cmd, f.fs.Arg(0), f.cmd)
		}
		f.args = append(f.args, f.fs.Arg(0))
		rest = f.fs.Args()[1:]
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
			return
		}
		f.fromEnv[fl.Name] = true
	})
	if err != nil {
		return err
	}
	f.fs.VisitAll(func(fl *flag.Flag) {
		if err == nil && given[fl.Name] && f.nonEmpty[fl.Name] && fl.Value.String() == "" {
			err = usagef("%s: --%s must not be empty", f.cmd, fl.Name)
		}
	})
	return err
}

func (f *flagSet) printHelp(w io.Writer) {
	operands := ""
	if f.operands != "" {
		operands = " " + f.operands
	}
	fmt.Fprintf(w, "Usage: stagedrain %s [flags]%s\n\n%s\n", f.cmd, operands, f.desc)
	n := 0
	f.fs.VisitAll(func(*flag.Flag) { n++ })
	if n == 0 {
		return
	}
	fmt.Fprint(w, "\nFlags:\n")
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

// commandFlags returns the flags of every command that has flags, in the
// order of the usage text. For dead, the flags its subcommands share; their
// own (--json, --all, --older-than) say what to do, not how to connect, and
// have no environment variable: a leftover STAGEDRAIN_* must never purge.
func commandFlags() []*flagSet {
	m, _ := newMigrateFlags()
	r, _ := newRunFlags()
	s, _ := newStatusFlags()
	h, _ := newHealthFlags()
	b, _ := newBenchFlags()
	d, _ := newDeadFlags("dead", "")
	return []*flagSet{m, r, s, h, b, d}
}

// unknownEnv returns, sorted, the names of the STAGEDRAIN_* variables of
// environ (as os.Environ returns it) that no command reads. A variable of
// any command counts as known under every command, so that one environment
// can serve them all (bench's STAGEDRAIN_BENCH_* under run, say).
func unknownEnv(environ []string) []string {
	known := make(map[string]bool)
	for _, f := range commandFlags() {
		for _, env := range f.envs {
			known[env] = true
		}
	}
	var unknown []string
	for _, kv := range environ {
		name, _, _ := strings.Cut(kv, "=")
		if strings.HasPrefix(name, "STAGEDRAIN_") && !known[name] && !slices.Contains(unknown, name) {
			unknown = append(unknown, name)
		}
	}
	slices.Sort(unknown)
	return unknown
}
