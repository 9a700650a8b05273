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
	t := deadTables(c.schema)
	var exists bool
	if err := conn.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, t.dead).Scan(&exists); err != nil {
		return fmt.Errorf("%s: look up %s: %w", f.cmd, t.dead, err)
	}
	if !exists {
		return fmt.Errorf("%s: %s does not exist: run 'stagedrain migrate' first", f.cmd, t.dead)
	}
	switch args[0] {
	case "list":
		err = deadList(ctx, conn, t, c.json, stdout)
	case "retry":
		err = deadRetry(ctx, conn, t, ids, stdout)
	case "purge":
		err = deadPurge(ctx, conn, t, ids, olderThan, stdout)
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

// deadSQL are the quoted names of one schema's tables.
type deadSQL struct{ staged, dead string }

func deadTables(schema string) deadSQL {
	return deadSQL{
		staged: pgx.Identifier{schema, "staged_jobs"}.Sanitize(),
		dead:   pgx.Identifier{schema, "staged_jobs_dead"}.Sanitize(),
	}
}

// deadJob is a row of staged_jobs_dead, as list --json prints it.
type deadJob struct {
	ID        int64           `json:"id"`
	JobName   *string         `json:"job_name"`
	JobArgs   json.RawMessage `json:"job_args"`
	Queue     *string         `json:"queue"`
	RunAt     *time.Time      `json:"run_at"`
	JID       *string         `json:"jid"`
	CreatedAt *time.Time      `json:"created_at"`
	Options   json.RawMessage `json:"options"`
	Reason    string          `json:"reason"`
	FailedAt  time.Time       `json:"failed_at"`
	Attempts  int             `json:"attempts"`
}

func deadList(ctx context.Context, conn *pgx.Conn, t deadSQL, asJSON bool, w io.Writer) error {
	rows, err := conn.Query(ctx, `SELECT id, job_name, job_args::text, queue, run_at, jid, created_at, options::text,
		reason, failed_at, attempts FROM `+t.dead+` ORDER BY id`)
	if err != nil {
		return fmt.Errorf("read dead rows: %w", err)
	}
	jobs, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (deadJob, error) {
		var j deadJob
		var args, opts *string
		err := r.Scan(&j.ID, &j.JobName, &args, &j.Queue, &j.RunAt, &j.JID, &j.CreatedAt, &opts, &j.Reason, &j.FailedAt, &j.Attempts)
		j.JobArgs, j.Options = rawJSON(args), rawJSON(opts)
		return j, err
	})
	if err != nil {
		return fmt.Errorf("read dead rows: %w", err)
	}
	if asJSON {
		if jobs == nil {
			jobs = []deadJob{}
		}
		b, err := json.MarshalIndent(jobs, "", "  ")
		if err != nil {
			return err
		}
		_, err = fmt.Fprintf(w, "%s\n", b)
		return err
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tJID\tJOB_NAME\tQUEUE\tFAILED_AT\tREASON")
	for _, j := range jobs {
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%s\n", j.ID, orNull(j.JID), orNull(j.JobName), orNull(j.Queue),
			j.FailedAt.UTC().Format(time.RFC3339), oneLine(j.Reason))
	}
	return tw.Flush()
}

func rawJSON(s *string) json.RawMessage {
	if s == nil {
		return json.RawMessage("null")
	}
	return json.RawMessage(*s)
}

func orNull(s *string) string {
	if s == nil {
		return "NULL"
	}
	return *s
}

// columns are staged_jobs' columns, which staged_jobs_dead keeps too.
const columns = `id, job_name, job_args, queue, run_at, jid, created_at, options`

// deadRetry moves the rows ids (all of them when ids is empty) back into
// staged_jobs, in one transaction.
func deadRetry(ctx context.Context, conn *pgx.Conn, t deadSQL, ids []int64, w io.Writer) error {
	var n int64
	err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
		if err := lockDead(ctx, tx, t, ids); err != nil {
			return err
		}
		tag, err := tx.Exec(ctx, `WITH moved AS (DELETE FROM `+t.dead+` WHERE $1::bigint[] IS NULL OR id = ANY($1)
			RETURNING `+columns+`)
			INSERT INTO `+t.staged+` (`+columns+`) SELECT `+columns+` FROM moved`, nilIfEmpty(ids))
		if err != nil {
			return fmt.Errorf("move dead rows back: %w", err)
		}
		n = tag.RowsAffected()
		return nil
	})
	if err != nil {
		return err
	}
	_, err = fmt.Fprintf(w, "moved %d dead %s back into staged_jobs\n", n, plural(n, "row", "rows"))
	return err
}

// deadPurge deletes the rows ids, or those that died more than olderThan
// ago, or (neither given) all of them.
func deadPurge(ctx context.Context, conn *pgx.Conn, t deadSQL, ids []int64, olderThan time.Duration, w io.Writer) error {
	var n int64
	err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
		if err := lockDead(ctx, tx, t, ids); err != nil {
			return err
		}
		var age any
		if olderThan > 0 {
			age = olderThan
		}
		tag, err := tx.Exec(ctx, `DELETE FROM `+t.dead+` WHERE ($1::bigint[] IS NULL OR id = ANY($1))
			AND ($2::interval IS NULL OR failed_at < now() - $2::interval)`, nilIfEmpty(ids), age)
		if err != nil {
			return fmt.Errorf("delete dead rows: %w", err)
		}
		n = tag.RowsAffected()
		return nil
	})
	if err != nil {
		return err
	}
	_, err = fmt.Fprintf(w, "purged %d dead %s\n", n, plural(n, "row", "rows"))
	return err
}

// lockDead locks the dead rows ids and fails, naming them, if any is not
// there. With no ids it does nothing.
func lockDead(ctx context.Context, tx pgx.Tx, t deadSQL, ids []int64) error {
	if len(ids) == 0 {
		return nil
	}
	rows, err := tx.Query(ctx, `SELECT id FROM `+t.dead+` WHERE id = ANY($1) FOR UPDATE`, ids)
	if err != nil {
		return fmt.Errorf("read dead rows: %w", err)
	}
	found, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return fmt.Errorf("read dead rows: %w", err)
	}
	var missing []string
	for _, id := range ids {
		if !slices.Contains(found, id) {
			missing = append(missing, strconv.FormatInt(id, 10))
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("no dead row with id %s: nothing changed", strings.Join(missing, ", "))
	}
	return nil
}

func nilIfEmpty(ids []int64) []int64 {
	if len(ids) == 0 {
		return nil
	}
	return ids
}

func plural(n int64, one, many string) string {
	if n == 1 {
		return one
	}
	return many
}
