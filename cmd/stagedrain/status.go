package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/admin"
)

// statusFlags are status's flags.
type statusFlags struct {
	databaseURL    string
	schema         string
	schemas        string
	source         string
	json           bool
	redisURL       string
	redisMode      string
	redisNamespace string
}

// newStatusFlags declares status's flags.
func newStatusFlags() (*flagSet, *statusFlags) {
	f := newFlagSet("status", "Show a schema's backlog by queue, its oldest staged job's age, its dead-letter\n"+
		"count and which relay leads (each --queues group's), from PostgreSQL alone (no\n"+
		"relay need run); with --redis-url, also the queues its leaders pause for\n"+
		"backpressure.")
	c := new(statusFlags)
	f.fs.StringVar(&c.databaseURL, "database-url", "", "PostgreSQL connection `URL` (required; never logged)")
	f.env("database-url", "DATABASE_URL")
	f.fs.StringVar(&c.schema, "schema", "public", "PostgreSQL `schema` of the staged_jobs table")
	f.env("schema", "STAGEDRAIN_SCHEMA")
	registerSchemas(f, &c.schemas, "show these `schemas` instead of --schema, one block each: a comma list of names and patterns with '*' (tenant_*), which match the schemas holding the table of --source")
	f.fs.StringVar(&c.source, "source", string(relay.SourceStagedJobs), "the `table` drained: staged_jobs, or sidekiq_staged_push (the sidekiq-staged_push gem's sidekiq_staged_push_jobs)")
	f.env("source", "STAGEDRAIN_SOURCE")
	f.fs.BoolVar(&c.json, "json", false, "print one JSON object instead of a table (with --schemas, an array of them)")
	f.env("json", "STAGEDRAIN_STATUS_JSON")
	f.fs.StringVar(&c.redisURL, "redis-url", "", "the relays' Redis `URL`, to show the queues their leader pauses for backpressure (password never logged); none: pauses are not shown")
	f.env("redis-url", "REDIS_URL")
	f.fs.StringVar(&c.redisMode, "redis-mode", "single", "the `mode` of --redis-url, as run's: single, cluster or sentinel")
	f.env("redis-mode", "STAGEDRAIN_REDIS_MODE")
	f.fs.StringVar(&c.redisNamespace, "redis-namespace", "", "the relays' `namespace` (their --redis-namespace), with --redis-url")
	f.env("redis-namespace", "STAGEDRAIN_REDIS_NAMESPACE")
	f.required("database-url", "schema", "source", "redis-mode")
	return f, c
}

// redisClient returns status's Redis client for --redis-url and
// --redis-mode, nil without --redis-url.
func (c *statusFlags) redisClient(f *flagSet) (redis.UniversalClient, error) {
	if c.redisURL == "" {
		return nil, nil
	}
	const name = "stagedrain-status"
	switch c.redisMode {
	case "single":
		o, err := redis.ParseURL(c.redisURL)
		if err != nil {
			return nil, usagef("status: %s cannot be parsed (want redis://[user:password@]host:port/db, or rediss:// for TLS)", f.source("redis-url"))
		}
		o.ClientName, o.DisableIdentity, o.Dialer = name, true, redisDialer(o.DialTimeout, o.TLSConfig)
		return redis.NewClient(o), nil
	case "cluster":
		o, err := redis.ParseClusterURL(c.redisURL)
		if err != nil {
			return nil, usagef("status: %s cannot be parsed as a cluster URL (want redis://[user:password@]host1:port1?addr=host2:port2&addr=host3:port3)", f.source("redis-url"))
		}
		o.ClientName, o.DisableIdentity, o.Dialer = name, true, redisDialer(o.DialTimeout, o.TLSConfig)
		return redis.NewClusterClient(o), nil
	case "sentinel":
		o, err := redis.ParseFailoverURL(c.redisURL)
		if err != nil || o.MasterName == "" {
			return nil, usagef("status: %s cannot be parsed as a sentinel URL (want redis://[user:password@]sentinel1:26379/db?master_name=mymaster&addr=sentinel2:26379[&password=...])", f.source("redis-url"))
		}
		o.ClientName, o.DisableIdentity, o.Dialer = name, true, redisDialer(o.DialTimeout, o.TLSConfig)
		return redis.NewFailoverClient(o), nil
	default:
		return nil, usagef("status: %s must be single, cluster or sentinel, got %q", f.source("redis-mode"), c.redisMode)
	}
}

// schemaStatus is what status shows; its JSON is status --json's output.
type (
	schemaStatus = admin.SchemaStatus
	queueStatus  = admin.QueueStatus
	leaderStatus = admin.LeaderStatus
)

// statusOut is a schema's status with what only some runs show: the
// paused queues (with --redis-url; nil without), and, with --schemas, why
// a schema could not be read (SchemaStatus nil then).
type statusOut struct {
	Schema string `json:"schema"` // hides SchemaStatus's, which is the same
	*admin.SchemaStatus
	Paused *[]pausedQueue `json:"paused,omitempty"`
	Error  string         `json:"error,omitempty"`
}

func statusCmd(ctx context.Context, args []string, stdout, stderr io.Writer) error {
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
	items, err := schemasFlag(f, c.schemas)
	if err != nil {
		return err
	}
	src := relay.Source(c.source)
	if err := relay.CheckSource(src); err != nil {
		reason := err.Error()
		if fe := (*relay.FieldError)(nil); errors.As(err, &fe) {
			reason = fe.Reason
		}
		return usagef("status: %s %s", f.source("source"), reason)
	}
	rdb, err := c.redisClient(f)
	if err != nil {
		return err
	}
	if rdb != nil {
		defer rdb.Close()
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
	// paused reads a schema's paused queues, once Redis answered: after a
	// failure, the others are not tried (and shown unknown).
	var redisErr error
	paused := func(schema string) *[]pausedQueue {
		if rdb == nil || redisErr != nil {
			return nil
		}
		p, err := admin.ReadPaused(ctx, rdb, c.redisNamespace, cfg.Database, schema)
		if err != nil {
			redisErr = fmt.Errorf("status: %s: %w", relay.DescribeRedis(rdb), err)
			return nil
		}
		q := []pausedQueue{}
		for _, p := range p {
			q = append(q, pausedQueue{Queue: p.Queue, Reason: p.Reason})
		}
		return &q
	}

	if items == nil {
		st, err := admin.ReadStatus(ctx, conn, admin.StatusParams{Schema: c.schema, Source: src})
		if err != nil {
			return fmt.Errorf("status: %w", err)
		}
		out := statusOut{Schema: st.Schema, SchemaStatus: st, Paused: paused(c.schema)}
		if c.json {
			enc := json.NewEncoder(stdout)
			enc.SetIndent("", "  ")
			var v any = st // without Redis, exactly as before
			if rdb != nil {
				v = out
			}
			if err := enc.Encode(v); err != nil {
				return err
			}
		} else {
			printStatus(stdout, out, rdb != nil)
		}
		return redisErr
	}

	table := sourceTable(src)
	schemas, err := expandSchemas(ctx, conn, items, table, func(pattern string) {
		fmt.Fprintf(stderr, "stagedrain: status: warning: no schema holding %s matches %q\n", table, pattern)
	})
	if err != nil {
		return fmt.Errorf("status: %w", err)
	}
	if len(schemas) == 0 {
		return fmt.Errorf("status: no schema holding %s matches %q", table, strings.Join(items, ","))
	}
	outs := make([]statusOut, 0, len(schemas))
	var failed []string
	for _, schema := range schemas {
		st, err := admin.ReadStatus(ctx, conn, admin.StatusParams{Schema: schema, Source: src})
		if err != nil {
			if ctx.Err() != nil {
				return fmt.Errorf("status: %w", err)
			}
			outs = append(outs, statusOut{Schema: schema, Error: oneLine(err.Error())})
			failed = append(failed, schema)
			continue
		}
		outs = append(outs, statusOut{Schema: schema, SchemaStatus: st, Paused: paused(schema)})
	}
	if c.json {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(outs); err != nil {
			return err
		}
	} else {
		for i, out := range outs {
			if i > 0 {
				fmt.Fprintln(stdout)
			}
			printStatus(stdout, out, rdb != nil)
		}
	}
	if len(failed) > 0 {
		return fmt.Errorf("status: %d of %d schemas could not be read: %s", len(failed), len(schemas), strings.Join(failed, ", "))
	}
	return redisErr
}

// printStatus writes a schema's status as a table for people; withPaused,
// its paused queues ("unknown" when Redis did not answer).
func printStatus(w io.Writer, out statusOut, withPaused bool) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	defer tw.Flush()
	fmt.Fprintf(tw, "schema\t%s\n", out.Schema)
	st := out.SchemaStatus
	if st == nil {
		fmt.Fprintf(tw, "error\t%s\n", out.Error)
		return
	}
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
	// One line per group of relays, named by its queues unless it is
	// the one group, of every queue.
	switch {
	case len(st.Groups) == 0:
		fmt.Fprintf(tw, "leader\tnone\n")
	case len(st.Groups) == 1 && st.Groups[0].Queues == nil:
		fmt.Fprintf(tw, "leader\t%s\n", describeLeader(st.Groups[0].Leader))
	default:
		for _, g := range st.Groups {
			group := "all queues"
			if g.Queues != nil {
				group = "queues " + strings.Join(g.Queues, ",")
			}
			fmt.Fprintf(tw, "leader\t%s: %s\n", group, describeLeader(g.Leader))
		}
	}
	if withPaused {
		switch {
		case out.Paused == nil:
			fmt.Fprintf(tw, "paused\tunknown (Redis did not answer)\n")
		case len(*out.Paused) == 0:
			fmt.Fprintf(tw, "paused\tnone\n")
		}
		if out.Paused != nil {
			for _, p := range *out.Paused {
				what := p.Queue
				if p.Queue == "*" {
					what = "* (every queue)"
				}
				fmt.Fprintf(tw, "paused\t%s (%s)\n", what, p.Reason)
			}
		}
	}
	if len(st.Queues) > 0 {
		fmt.Fprintf(tw, "\nQUEUE\tSTAGED\tOLDEST\n")
		for _, q := range st.Queues {
			fmt.Fprintf(tw, "%s\t%d\t%s\n", q.Queue, q.Staged, age(q.OldestAge))
		}
	}
}

// describeLeader says who leads, for people: "none" for nil.
func describeLeader(l *leaderStatus) string {
	if l == nil {
		return "none"
	}
	who := l.ApplicationName
	if l.Host != "" {
		who = fmt.Sprintf("%s pid %d", l.Host, l.PID)
	}
	from := ""
	if l.ClientAddr != "" {
		from = " from " + l.ClientAddr
	}
	return fmt.Sprintf("%s (backend %d%s, connected %s)", who, l.BackendPID, from, l.ConnectedAt.Format(time.RFC3339))
}

// age formats seconds for people: 0.4s, 12s, 3m20s, 5h2m0s.
func age(seconds float64) string {
	d := time.Duration(seconds * float64(time.Second))
	if d < 10*time.Second {
		return d.Round(100 * time.Millisecond).String()
	}
	return d.Round(time.Second).String()
}
