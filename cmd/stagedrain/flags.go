package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"
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
	bad      *badValue         // the value the last Set refused, during parse
}

// badValue is a flag value Set refused: which flag, what was given, and
// what kind of value the flag takes.
type badValue struct {
	name, given string
	kind, want  string // "boolean", "true or false, 1 or 0"; "" when the kind is unknown
	err         error  // Set's own error, for a kind not known
}

// valueKind names the kind of value a flag takes, and what it accepts, for
// the message of a value Set refused.
func valueKind(v flag.Value) (kind, want string) {
	g, ok := v.(flag.Getter)
	if !ok {
		return "", ""
	}
	switch g.Get().(type) {
	case bool:
		return "boolean", "true or false, 1 or 0"
	case int, int64:
		return "integer", "a whole number, such as 100"
	case uint, uint64:
		return "integer", "a whole number of 0 or more, such as 100"
	case float64:
		return "number", "such as 0.5"
	case time.Duration:
		return "duration", "a number and a unit: 300ms, 5s, 2m, 1h"
	}
	return "", ""
}

// checkedValue is a flag's value that records, in its flagSet, what it
// refused: the flag package says only "parse error".
type checkedValue struct {
	flag.Value
	name string
	set  *flagSet
}

func (v *checkedValue) Set(s string) error {
	err := v.Value.Set(s)
	if err != nil {
		kind, want := valueKind(v.Value)
		v.set.bad = &badValue{name: v.name, given: s, kind: kind, want: want, err: err}
	}
	return err
}

// IsBoolFlag keeps a boolean flag one that takes no value ("--json").
func (v *checkedValue) IsBoolFlag() bool {
	b, ok := v.Value.(interface{ IsBoolFlag() bool })
	return ok && b.IsBoolFlag()
}

// Get keeps the value a flag.Getter.
func (v *checkedValue) Get() any {
	if g, ok := v.Value.(flag.Getter); ok {
		return g.Get()
	}
	return v.Value.String()
}

// check wraps every flag's value in a checkedValue, once.
func (f *flagSet) check() {
	f.fs.VisitAll(func(fl *flag.Flag) {
		if _, done := fl.Value.(*checkedValue); !done {
			fl.Value = &checkedValue{Value: fl.Value, name: fl.Name, set: f}
		}
	})
}

// message says what is wrong with b, given on the command line, or (given
// == false) from the flag's environment variable, which is never echoed: it
// may be a URL with a password.
func (b *badValue) message(echo bool) string {
	what := "invalid value"
	if b.kind != "" {
		what = "invalid " + b.kind
		if errors.Is(b.err, strconv.ErrRange) || strings.Contains(b.err.Error(), "out of range") {
			what = b.kind + " out of range"
		}
	}
	if echo {
		what += " " + strconv.Quote(b.given)
	}
	if b.kind == "" {
		return what + ": " + b.err.Error()
	}
	return what + " (want " + b.want + ")"
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

// isSet reports whether flag name was given, on the command line or by its
// environment variable, after parse.
func (f *flagSet) isSet(name string) bool {
	set := f.fromEnv[name]
	f.fs.Visit(func(fl *flag.Flag) { set = set || fl.Name == name })
	return set
}

// singleDash matches the "-name" the flag package writes in its errors.
var singleDash = regexp.MustCompile(`(^|[\s:])-([a-zA-Z])`)

// parse parses args, then fills each flag not given from its environment
// variable. --help prints the flags to stdout and returns errHelp.
func (f *flagSet) parse(args []string, stdout io.Writer) error {
	f.check()
	// Operands and flags may mix ("retry 4 5 --database-url ..."): parse
	// again after each operand.
	for rest := args; ; {
		f.bad = nil
		if err := f.fs.Parse(rest); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				f.printHelp(stdout)
				return errHelp
			}
			if b := f.bad; b != nil {
				return usagef("%s: --%s: %s", f.cmd, b.name, b.message(true))
			}
			msg := singleDash.ReplaceAllString(err.Error(), "$1--$2")
			return usagef("%s: %s (see 'stagedrain %s --help')", f.cmd, msg, f.cmd)
		}
		if f.fs.NArg() == 0 {
			break
		}
		if err := f.boolWithSpace(rest); err != nil {
			return err
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
		f.bad = nil
		if e := fl.Value.Set(v); e != nil {
			// Never echo the value: it may be a URL with a password.
			msg := e.Error()
			if f.bad != nil {
				msg = f.bad.message(false)
			}
			err = usagef("%s: $%s (--%s): %s", f.cmd, env, fl.Name, msg)
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

// boolWithSpace refuses "--json false", which the flag package reads as
// --json (true) and the operand "false": a boolean flag takes its value
// after "=". rest is what the last Parse was given.
func (f *flagSet) boolWithSpace(rest []string) error {
	i := len(rest) - f.fs.NArg() - 1 // the argument before the first operand
	if i < 0 || rest[i] == "--" {
		return nil
	}
	name := strings.TrimPrefix(strings.TrimPrefix(rest[i], "-"), "-")
	fl := f.fs.Lookup(name)
	if fl == nil || name == rest[i] || strings.Contains(name, "=") {
		return nil
	}
	if b, ok := fl.Value.(interface{ IsBoolFlag() bool }); !ok || !b.IsBoolFlag() {
		return nil
	}
	v := f.fs.Arg(0)
	if _, err := strconv.ParseBool(v); err != nil {
		return nil
	}
	return usagef("%s: --%s takes its value after \"=\": --%s=%s, not --%s %s", f.cmd, name, name, v, name, v)
}

func (f *flagSet) printHelp(w io.Writer) {
	operands := ""
	if f.operands != "" {
		operands = " " + f.operands
	}
	fmt.Fprintf(w, "Usage: stagedrain %s [flags]%s\n\n%s\n", f.cmd, operands, f.desc)
	f.printFlags(w, "\nFlags:\n", nil)
}

// printFlags writes title, then each flag but those of skip, with its
// placeholder, usage and default; it writes nothing, title included, when
// there is no such flag. It returns how many flags it wrote.
func (f *flagSet) printFlags(w io.Writer, title string, skip map[string]bool) int {
	n := 0
	f.fs.VisitAll(func(fl *flag.Flag) {
		if skip[fl.Name] {
			return
		}
		if n == 0 {
			fmt.Fprint(w, title)
		}
		n++
		plain := *fl // UnquoteUsage names a placeholder by the value's type
		if cv, ok := fl.Value.(*checkedValue); ok {
			plain.Value = cv.Value
		}
		name, usage := flag.UnquoteUsage(&plain)
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
	return n
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
