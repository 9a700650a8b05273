package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/stagedrain/stagedrain/relay"
)

// statusFlags are status's flags.
type statusFlags struct {
	databaseURL string
	schema      string
	source      string
	json        bool
}

// newStatusFlags declares status's flags.
func newStatusFlags() (*flagSet, *statusFlags) {
	f := newFlagSet("status", "Show a schema's backlog by queue, its oldest staged job's age, its dead-letter\n"+
		"count and which relay leads, from PostgreSQL alone (no relay need run).")
	c := new(statusFlags)
	f.fs.StringVar(&c.databaseURL, "database-url", "", "PostgreSQL connection `URL` (required; never logged)")
	f.env("database-url", "DATABASE_URL")
	f.fs.StringVar(&c.schema, "schema", "public", "PostgreSQL `schema` of the staged_jobs table")
	f.env("schema", "STAGEDRAIN_SCHEMA")
	f.fs.StringVar(&c.source, "source", string(relay.SourceStagedJobs), "the `table` drained: staged_jobs, or sidekiq_staged_push (the sidekiq-staged_push gem's sidekiq_staged_push_jobs)")
	f.env("source", "STAGEDRAIN_SOURCE")
	f.fs.BoolVar(&c.json, "json", false, "print one JSON object instead of a table")
	f.env("json", "STAGEDRAIN_STATUS_JSON")
	f.required("database-url", "schema", "source")
	return f, c
}

// schemaStatus is what status shows; its JSON is status --json's output.
type (
	schemaStatus = relay.SchemaStatus
	queueStatus  = relay.QueueStatus
	leaderStatus = relay.LeaderStatus
)

func statusCmd(ctx context.Context, args []string, stdout io.Writer) error {
	f, c := newStatusFlags()
	if err := f.parse(args, stdout); err != nil {
		return err
	}
	if c.databaseURL == "" {
		return usagef("status: --database-url or $DATABASE_URL is required")
	}
	if err := relay.CheckDatabaseURL(c.databaseURL); err != nil {
		return usagef("status: %s: %s", f.source("database-url"), err)
	}
	if err := relay.CheckSchema(c.schema); err != nil {
		reason := err.Error()
		if fe := (*relay.FieldError)(nil); errors.As(err, &fe) {
			reason = fe.Reason
		}
		return usagef("status: %s %s", f.source("schema"), reason)
	}
	if err := relay.CheckSource(relay.Source(c.source)); err != nil {
		reason := err.Error()
		if fe := (*relay.FieldError)(nil); errors.As(err, &fe) {
			reason = fe.Reason
		}
		return usagef("status: %s %s", f.source("source"), reason)
	}
	cfg, err := pgx.ParseConfig(c.databaseURL)
	if err != nil { // CheckDatabaseURL parsed it already
		return usagef("status: %s cannot be parsed", f.source("database-url"))
	}
	tuneCommandConn(cfg, "stagedrain status")
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return fmt.Errorf("status: connect to %s: %w", relay.DescribeDatabase(c.databaseURL), err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	st, err := relay.ReadStatus(ctx, conn, relay.StatusParams{Schema: c.schema, Source: relay.Source(c.source)})
	if err != nil {
		return fmt.Errorf("status: %w", err)
	}
	if c.json {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(st)
	}
	printStatus(stdout, st)
	return nil
}

// printStatus writes st as a table for people.
func printStatus(w io.Writer, st *schemaStatus) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "schema\t%s\n", st.Schema)
	staged := strconv.FormatInt(st.Staged, 10)
	if st.OldestAge != nil {
		staged += ", oldest " + age(*st.OldestAge)
	}
	fmt.Fprintf(tw, "staged\t%s\n", staged)
	dead := "-"
	if st.Dead != nil {
		dead = strconv.FormatInt(*st.Dead, 10)
	}
	fmt.Fprintf(tw, "dead\t%s\n", dead)
	if st.Poison != nil {
		fmt.Fprintf(tw, "poison\t%d (left staged, skipped)\n", *st.Poison)
	}
	leader := "none"
	if l := st.Leader; l != nil {
		who := l.ApplicationName
		if l.Host != "" {
			who = fmt.Sprintf("%s pid %d", l.Host, l.PID)
		}
		from := ""
		if l.ClientAddr != "" {
			from = " from " + l.ClientAddr
		}
		leader = fmt.Sprintf("%s (backend %d%s, connected %s)", who, l.BackendPID, from, l.ConnectedAt.Format(time.RFC3339))
	}
	fmt.Fprintf(tw, "leader\t%s\n", leader)
	if len(st.Queues) > 0 {
		fmt.Fprintf(tw, "\nQUEUE\tSTAGED\tOLDEST\n")
		for _, q := range st.Queues {
			fmt.Fprintf(tw, "%s\t%d\t%s\n", q.Queue, q.Staged, age(q.OldestAge))
		}
	}
	_ = tw.Flush()
}

// age formats seconds for people: 0.4s, 12s, 3m20s, 5h2m0s.
func age(seconds float64) string {
	d := time.Duration(seconds * float64(time.Second))
	if d < 10*time.Second {
		return d.Round(100 * time.Millisecond).String()
	}
	return d.Round(time.Second).String()
}
