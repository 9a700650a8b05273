package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/admin"
)

// deadFlags are the flags of the dead subcommands: where the table is, and
// which rows to act on.
type deadFlags struct {
	commonFlags
	json      bool
	all       bool
	olderThan string
}

// newDeadFlags declares the flags of "dead <sub>": --database-url and
// --schema, with their environment variables, and the subcommand's own.
func newDeadFlags(cmd, desc string) (*flagSet, *deadFlags) {
	f := newFlagSet(cmd, desc)
	c := new(deadFlags)
	c.registerDatabase(f)
	switch cmd {
	case "dead list":
		f.fs.BoolVar(&c.json, "json", false, "print a JSON array of objects instead of a table")
	case "dead retry":
		f.operands = "ID...|--all"
		f.fs.BoolVar(&c.all, "all", false, "move every dead row back")
	case "dead purge":
		f.operands = "ID...|--all|--older-than DURATION"
		f.fs.BoolVar(&c.all, "all", false, "delete every dead row")
		f.fs.StringVar(&c.olderThan, "older-than", "", "delete the rows that died more than `DURATION` ago (36h, 7d)")
	}
	return f, c
}

const deadUsage = "want list, retry or purge (see 'stagedrain dead --help')"

// deadSub is a subcommand of dead.
type deadSub struct {
	name, short, desc string
}

var deadSubs = []deadSub{
	{"list", "show the dead rows, oldest id first",
		"Show the rows of staged_jobs_dead: jobs the relay could never push, oldest id first."},
	{"retry", "move dead rows back into staged_jobs, keeping id and jid",
		"Move dead rows back into staged_jobs, keeping their id and jid, in one transaction.\n" +
			"An ID that is not dead fails the command, and nothing moves."},
	{"purge", "delete dead rows (DURATION: 36h, 7d, ...)",
		"Delete dead rows, in one transaction. An ID that is not dead fails the command,\n" +
			"and nothing is deleted."},
}

// printDeadHelp writes dead's help: its subcommands, the flags they share,
// and each one's own.
func printDeadHelp(w io.Writer) {
	fmt.Fprint(w, "Usage: stagedrain dead list|retry|purge [flags]\n\n"+
		"Act on staged_jobs_dead: the jobs the relay could never push (Redis refused them,\n"+
		"or their payload was too big or malformed).\n\nSubcommands:\n")
	common, _ := newDeadFlags("dead", "")
	shared := make(map[string]bool)
	common.fs.VisitAll(func(fl *flag.Flag) { shared[fl.Name] = true })
	for _, sub := range deadSubs {
		f, _ := newDeadFlags("dead "+sub.name, sub.desc)
		line := "  stagedrain dead " + sub.name + " [flags]"
		if f.operands != "" {
			line += " " + f.operands
		}
		fmt.Fprintf(w, "%s\n        %s\n", line, sub.short)
	}
	common.printFlags(w, "\nFlags of every subcommand:\n", nil)
	for _, sub := range deadSubs {
		f, _ := newDeadFlags("dead "+sub.name, sub.desc)
		f.printFlags(w, "\nFlags of dead "+sub.name+":\n", shared)
	}
	fmt.Fprint(w, "\nRun 'stagedrain dead <subcommand> --help' for one subcommand alone.\n")
}

func deadCmd(ctx context.Context, args []string, stdout io.Writer) error {
	if len(args) == 0 {
		return usagef("dead: a subcommand is required: %s", deadUsage)
	}
	switch args[0] {
	case "-h", "-help", "--help", "help":
		printDeadHelp(stdout)
		return errHelp
	}
	i := slices.IndexFunc(deadSubs, func(s deadSub) bool { return s.name == args[0] })
	if i < 0 {
		return usagef("dead: unknown subcommand %q: %s", args[0], deadUsage)
	}
	f, c := newDeadFlags("dead "+args[0], deadSubs[i].desc)
	if err := f.parse(args[1:], stdout); err != nil {
		return err
	}
	if err := c.check(f); err != nil {
		return err
	}
	ids, olderThan, err := c.targets(f)
	if err != nil {
		return err
	}

	conn, err := connectDB(ctx, c.databaseURL, "stagedrain "+f.cmd)
	if err != nil {
		return fmt.Errorf("%s: connect to %s: %w", f.cmd, relay.DescribeDatabase(c.databaseURL), err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	switch args[0] {
	case "list":
		err = deadList(ctx, conn, c.schema, c.json, stdout)
	case "retry":
		var res *admin.RetryDeadResult
		if res, err = admin.RetryDead(ctx, conn, admin.RetryDeadParams{Schema: c.schema, IDs: ids, All: c.all}); err == nil {
			_, err = fmt.Fprintf(stdout, "moved %d dead %s back into staged_jobs\n", res.Moved, plural(res.Moved, "row", "rows"))
		}
	case "purge":
		var res *admin.PurgeDeadResult
		if res, err = admin.PurgeDead(ctx, conn, admin.PurgeDeadParams{Schema: c.schema, IDs: ids, All: c.all, OlderThan: olderThan}); err == nil {
			_, err = fmt.Fprintf(stdout, "purged %d dead %s\n", res.Purged, plural(res.Purged, "row", "rows"))
		}
	}
	if err != nil {
		return fmt.Errorf("%s: %w", f.cmd, err)
	}
	return nil
}

// targets checks which rows the command acts on: the ids given as
// operands, or --all, or --older-than (exactly one, for retry and purge).
func (c *deadFlags) targets(f *flagSet) (ids []int64, olderThan time.Duration, err error) {
	if ids, err = parseIDs(f); err != nil {
		return nil, 0, err
	}
	if c.olderThan != "" {
		if olderThan, err = parseAge(c.olderThan); err != nil {
			return nil, 0, usagef("%s: --older-than %s", f.cmd, err)
		}
	}
	if f.operands != "" {
		chosen := 0
		for _, set := range []bool{len(ids) > 0, c.all, c.olderThan != ""} {
			if set {
				chosen++
			}
		}
		if chosen != 1 {
			return nil, 0, usagef("%s: give exactly one of %s (see 'stagedrain %s --help')", f.cmd, f.operands, f.cmd)
		}
	}
	return ids, olderThan, nil
}

// parseIDs parses the operands as row ids.
func parseIDs(f *flagSet) ([]int64, error) {
	var ids []int64
	for _, a := range f.args {
		id, err := strconv.ParseInt(a, 10, 64)
		if err != nil || id < 1 {
			return nil, usagef("%s: %q is not a row id (a positive integer)", f.cmd, a)
		}
		if !slices.Contains(ids, id) {
			ids = append(ids, id)
		}
	}
	return ids, nil
}

// parseAge parses a positive Go duration ("36h") or a number of days ("7d").
func parseAge(s string) (time.Duration, error) {
	var d time.Duration
	if days, ok := strings.CutSuffix(s, "d"); ok {
		n, err := strconv.Atoi(days)
		if err != nil || n > 100_000 {
			return 0, fmt.Errorf("%q is not a duration (want 36h, 7d, ...)", s)
		}
		d = time.Duration(n) * 24 * time.Hour
	} else {
		var err error
		if d, err = time.ParseDuration(s); err != nil {
			return 0, fmt.Errorf("%q is not a duration (want 36h, 7d, ...)", s)
		}
	}
	if d <= 0 {
		return 0, fmt.Errorf("must be positive, got %s", s)
	}
	return d, nil
}

func deadList(ctx context.Context, conn *pgx.Conn, schema string, asJSON bool, w io.Writer) error {
	res, err := admin.ListDead(ctx, conn, admin.ListDeadParams{Schema: schema})
	if err != nil {
		return err
	}
	if asJSON {
		b, err := json.MarshalIndent(res.Jobs, "", "  ")
		if err != nil {
			return err
		}
		_, err = fmt.Fprintf(w, "%s\n", b)
		return err
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tJID\tJOB_NAME\tQUEUE\tFAILED_AT\tREASON")
	for _, j := range res.Jobs {
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%s\n", j.ID, orNull(j.JID), orNull(j.JobName), orNull(j.Queue),
			j.FailedAt.UTC().Format(time.RFC3339), oneLine(j.Reason))
	}
	return tw.Flush()
}

func orNull(s *string) string {
	if s == nil {
		return "NULL"
	}
	return *s
}

func plural(n int64, one, many string) string {
	if n == 1 {
		return one
	}
	return many
}
