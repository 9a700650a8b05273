// Command stagedrain relays transactionally staged jobs from PostgreSQL to
// Redis job queues.
//
//	stagedrain migrate   create or upgrade staged_jobs and its trigger
//	stagedrain run       drain committed jobs into Redis until stopped
//	stagedrain status    show the backlog, the dead letters and who leads
//	stagedrain health    exit 0 if the local relay is ready (a healthcheck)
//	stagedrain dead      list, retry or purge the rows that could never be pushed
//	stagedrain bench     measure the relay and its cost on this machine
//	stagedrain version   print the version (or stagedrain --version)
//
// Every flag has an environment variable: DATABASE_URL, REDIS_URL, and
// STAGEDRAIN_* for the rest. A flag on the command line wins over its
// variable. Exit codes: 0 done (or stopped by SIGINT/SIGTERM), 1 a failure at
// run time, 2 a bad command line.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"unicode"

	"github.com/redis/go-redis/v9"
)

func main() {
	// go-redis prints its own unstructured lines to stderr when a dial
	// fails; the relay already logs each failed push with its error and
	// retry, so they would only break the JSON log stream.
	redis.SetLogger(silentRedisLog{})
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

type silentRedisLog struct{}

func (silentRedisLog) Printf(context.Context, string, ...any) {}

// usageError is a bad command line: exit 2.
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

// usageLine is how run prints a usage error: one line, even where the
// message names an argument as given (the flag package's do, unquoted), with
// control characters and line separators escaped as Go quotes them.
func usageLine(ue *usageError) string {
	var b strings.Builder
	b.WriteString("stagedrain: ")
	for _, r := range ue.msg {
		if unicode.IsControl(r) || r == '\u2028' || r == '\u2029' {
			q := strconv.QuoteRune(r)
			b.WriteString(q[1 : len(q)-1])
		} else {
			b.WriteRune(r)
		}
	}
	return b.String()
}

func usagef(format string, args ...any) error {
	return &usageError{msg: fmt.Sprintf(format, args...)}
}

const usage = `stagedrain relays transactionally staged jobs from PostgreSQL to Redis.

Usage:
  stagedrain migrate [flags]   create or upgrade staged_jobs and its NOTIFY trigger
  stagedrain run [flags]       drain committed jobs into Redis until SIGINT/SIGTERM
  stagedrain status [flags]    show the backlog by queue, dead letters and who leads
  stagedrain health [flags]    exit 0 if the relay here answers /readyz with 200, else 1
  stagedrain dead list [flags] [--json]
                               show the rows that could never be pushed (staged_jobs_dead)
  stagedrain dead retry [flags] ID...|--all
                               move dead rows back into staged_jobs, keeping id and jid
  stagedrain dead purge [flags] ID...|--all|--older-than DURATION
                               delete dead rows (DURATION: 36h, 7d, ...)
  stagedrain bench [flags]     measure latency, throughput and the relay's cost here
  stagedrain version           print the version (also: stagedrain --version)

Run 'stagedrain <command> --help' for a command's flags; 'stagedrain dead --help'
for dead's subcommands.
`

// run is the whole program; it returns the exit code.
func run(args []string, stdout, stderr io.Writer) int {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	go func() {
		<-ctx.Done()
		stop() // a second signal kills at once
	}()

	err := dispatch(ctx, args, stdout, stderr)
	switch {
	case err == nil:
		return 0
	case errors.Is(err, errHelp):
		return 0
	default:
		var ue *usageError
		if errors.As(err, &ue) {
			fmt.Fprintln(stderr, usageLine(ue))
			return 2
		}
		fmt.Fprintf(stderr, "stagedrain: %s\n", errLine(err))
		return 1
	}
}

func dispatch(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		return usagef("a command is required: migrate, run, status, health, dead, bench or version (see 'stagedrain --help')")
	}
	switch cmd, rest := args[0], args[1:]; cmd {
	case "migrate":
		return migrateCmd(ctx, rest, stdout)
	case "run":
		return runCmd(ctx, rest, stdout, stderr)
	case "status":
		return statusCmd(ctx, rest, stdout, stderr)
	case "health":
		return healthCmd(ctx, rest, stdout)
	case "dead":
		return deadCmd(ctx, rest, stdout)
	case "bench":
		return benchCmd(ctx, rest, stdout, stderr)
	case "version", "--version", "-version":
		return versionCmd(rest, stdout)
	case "-h", "-help", "--help", "help":
		fmt.Fprint(stdout, usage)
		return errHelp
	default:
		return usagef("unknown command %q: want migrate, run, status, health, dead, bench or version (see 'stagedrain --help')", cmd)
	}
}
