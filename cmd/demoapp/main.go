// Command demoapp is the application side of the docker-compose demo. It
// signs users up, one transaction each: INSERT the user, INSERT a
// WelcomeJob for it into staged_jobs, COMMIT. Every Nth transaction rolls
// back on purpose, and says so, so that the logs show each committed
// user's job reaching the worker (cmd/demoworker) through the relay, and
// no rolled-back user's job ever doing so.
//
// It uses plain SQL through pgx, as an app in any language would. It
// creates its own table, demo_users, next to staged_jobs; staged_jobs
// itself must exist already (stagedrain migrate, or run --migrate).
//
//	DATABASE_URL=postgres://postgres@127.0.0.1:5432/test go run ./cmd/demoapp --users 10
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Getenv, os.Stdout)
	stop()
	if errors.Is(err, flag.ErrHelp) {
		return
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "demoapp: %s\n", strings.ReplaceAll(err.Error(), "\n", " "))
		var ue usageError
		if errors.As(err, &ue) {
			os.Exit(2)
		}
		os.Exit(1)
	}
}

// usageError is a bad command line or environment variable: exit 2.
type usageError struct{ error }

// config is what the flags say.
type config struct {
	databaseURL   string
	schema        string
	users         int
	rollbackEvery int
	interval      time.Duration
}

// envs maps each flag to the environment variable that sets it when the
// command line does not.
var envs = [][2]string{
	{"database-url", "DATABASE_URL"},
	{"schema", "DEMOAPP_SCHEMA"},
	{"users", "DEMOAPP_USERS"},
	{"rollback-every", "DEMOAPP_ROLLBACK_EVERY"},
	{"interval", "DEMOAPP_INTERVAL"},
}

// parse reads the environment (through getenv), then the command line.
func parse(args []string, getenv func(string) string, out io.Writer) (config, error) {
	var c config
	fs := flag.NewFlagSet("demoapp", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.StringVar(&c.databaseURL, "database-url", "", "PostgreSQL connection URL (required)")
	fs.StringVar(&c.schema, "schema", "public", "schema of staged_jobs; demo_users is created there")
	fs.IntVar(&c.users, "users", 0, "users to sign up, then exit; 0 signs up users until SIGINT/SIGTERM")
	fs.IntVar(&c.rollbackEvery, "rollback-every", 4, "roll back every Nth transaction on purpose; 0 never")
	fs.DurationVar(&c.interval, "interval", 2*time.Second, "pause between two sign-ups")
	for _, fe := range envs {
		fs.Lookup(fe[0]).Usage += " [$" + fe[1] + "]"
		if v := getenv(fe[1]); v != "" {
			if err := fs.Set(fe[0], v); err != nil {
				return c, usageError{fmt.Errorf("$%s: %v", fe[1], err)}
			}
		}
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			fs.SetOutput(out)
			fmt.Fprintln(out, "Usage: demoapp [flags]\n\nSigns users up, staging a WelcomeJob for each in the same transaction.")
			fs.PrintDefaults()
			return c, err
		}
		return c, usageError{err}
	}
	switch {
	case fs.NArg() > 0:
		return c, usageError{fmt.Errorf("unexpected argument %q", fs.Arg(0))}
	case c.databaseURL == "":
		return c, usageError{errors.New("--database-url or $DATABASE_URL is required")}
	case c.schema == "":
		return c, usageError{errors.New("--schema must not be empty")}
	case c.users < 0 || c.rollbackEvery < 0 || c.interval < 0:
		return c, usageError{errors.New("--users, --rollback-every and --interval must not be negative")}
	}
	return c, nil
}

func run(ctx context.Context, args []string, getenv func(string) string, out io.Writer) error {
	c, err := parse(args, getenv, out)
	if err != nil {
		return err
	}
	logger := log.New(out, "", log.LUTC|log.Ldate|log.Ltime|log.Lmicroseconds)

	conn, err := pgx.Connect(ctx, c.databaseURL)
	if err != nil {
		return fmt.Errorf("connect: %w", err) // pgx's errors name the host, never the password
	}
	defer conn.Close(context.Background())

	staged := pgx.Identifier{c.schema, "staged_jobs"}.Sanitize()
	users := pgx.Identifier{c.schema, "demo_users"}.Sanitize()
	var found *string
	if err := conn.QueryRow(ctx, `SELECT to_regclass($1)::text`, staged).Scan(&found); err != nil {
		return fmt.Errorf("look up %s: %w", staged, err)
	}
	if found == nil {
		return fmt.Errorf("%s does not exist: run 'stagedrain migrate' (or 'stagedrain run --migrate') first", staged)
	}
	if _, err := conn.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+users+` (
		id         BIGSERIAL PRIMARY KEY,
		email      TEXT NOT NULL,
		created_at TIMESTAMPTZ NOT NULL DEFAULT now()
	)`); err != nil {
		return fmt.Errorf("create %s: %w", users, err)
	}
	insertUser := `INSERT INTO ` + users + ` (email) VALUES ($1) RETURNING id`
	// The job carries the signup's trace context: its traceparent, in
	// options, is where the relay reads it (README, "Tracing").
	stageJob := `INSERT INTO ` + staged + ` (job_name, queue, job_args, options)
		VALUES ('WelcomeJob', 'default', jsonb_build_array($1::bigint), jsonb_build_object('traceparent', $2::text)) RETURNING jid`
	// A tracer with no exporter: the demo only shows the trace id, in the
	// app's log and the worker's.
	tracer := sdktrace.NewTracerProvider().Tracer("demoapp")

	if c.rollbackEvery > 0 {
		logger.Printf("signing up users in schema %s; every transaction %d of %d rolls back on purpose", c.schema, c.rollbackEvery, c.rollbackEvery)
	} else {
		logger.Printf("signing up users in schema %s", c.schema)
	}
	for n := 1; c.users == 0 || n <= c.users; n++ {
		if n > 1 && c.interval > 0 {
			select {
			case <-ctx.Done():
				return nil
			case <-time.After(c.interval):
			}
		}
		if ctx.Err() != nil {
			return nil
		}
		email := fmt.Sprintf("user%d@example.com", n)
		rollback := c.rollbackEvery > 0 && n%c.rollbackEvery == 0
		// The user and its job: one transaction, so both or neither.
		spanCtx, span := tracer.Start(ctx, "signup")
		carrier := propagation.MapCarrier{}
		propagation.TraceContext{}.Inject(spanCtx, carrier)
		span.End()
		tx, err := conn.Begin(ctx)
		if err != nil {
			return stopped(ctx, fmt.Errorf("begin: %w", err))
		}
		var id int64
		var jid string
		err = tx.QueryRow(ctx, insertUser, email).Scan(&id)
		if err == nil {
			err = tx.QueryRow(ctx, stageJob, id, carrier.Get("traceparent")).Scan(&jid)
		}
		if err != nil {
			_ = tx.Rollback(context.Background())
			return stopped(ctx, fmt.Errorf("sign up %s: %w", email, err))
		}
		if rollback {
			if err := tx.Rollback(ctx); err != nil {
				return stopped(ctx, fmt.Errorf("roll back: %w", err))
			}
			logger.Printf("rolled back on purpose: user %d (%s) and its WelcomeJob jid=%s are gone; that job must never run", id, email, jid)
			continue
		}
		if err := tx.Commit(ctx); err != nil {
			return stopped(ctx, fmt.Errorf("commit: %w", err))
		}
		logger.Printf("committed: user %d (%s) and its WelcomeJob jid=%s, in one transaction", id, email, jid)
		logger.Printf("trace %s: signed up user %d", span.SpanContext().TraceID(), id)
	}
	return nil
}

// stopped returns nil for an error caused by SIGINT/SIGTERM, err otherwise.
func stopped(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return nil
	}
	return err
}
