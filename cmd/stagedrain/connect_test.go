package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/stagedrain/stagedrain/relay/relaytest"
)

// A short-lived command's connection gives up after commandConnectTimeout
// unless the URL says otherwise, dials with keepalives, and names itself
// unless the URL does.
func TestCommandConnConfig(t *testing.T) {
	cfg, err := pgx.ParseConfig("postgres://u@127.0.0.1:5432/db")
	if err != nil {
		t.Fatal(err)
	}
	tuneCommandConn(cfg, "stagedrain status")
	if cfg.ConnectTimeout != commandConnectTimeout || cfg.DialFunc == nil {
		t.Fatalf("ConnectTimeout %s, DialFunc set %v; want %s and a dialer", cfg.ConnectTimeout, cfg.DialFunc != nil, commandConnectTimeout)
	}
	if got := cfg.RuntimeParams["application_name"]; got != "stagedrain status" {
		t.Fatalf("application_name %q", got)
	}
	cfg, err = pgx.ParseConfig("postgres://u@127.0.0.1:5432/db?connect_timeout=3&application_name=mine")
	if err != nil {
		t.Fatal(err)
	}
	tuneCommandConn(cfg, "stagedrain status")
	if cfg.ConnectTimeout != 3*time.Second || cfg.RuntimeParams["application_name"] != "mine" {
		t.Fatalf("the URL's connect_timeout and application_name were overridden: %s, %q", cfg.ConnectTimeout, cfg.RuntimeParams["application_name"])
	}
}

// connectDB reaches the test database, named as asked, and fails on a
// port nobody listens on with an error, not a hang.
func TestConnectDB(t *testing.T) {
	ctx := context.Background()
	conn, err := connectDB(ctx, relaytest.DatabaseURL(), "stagedrain test")
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var name string
	if err := conn.QueryRow(ctx, "SELECT current_setting('application_name')").Scan(&name); err != nil || name != "stagedrain test" {
		t.Fatalf("application_name %q, %v", name, err)
	}
	_, err = connectDB(ctx, "postgres://u@127.0.0.1:1/db", "")
	if err == nil || !strings.Contains(err.Error(), "127.0.0.1") {
		t.Fatalf("connect to a closed port: %v, want a connection error", err)
	}
}
