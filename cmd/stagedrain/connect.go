package main

import (
	"context"
	"net"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/stagedrain/stagedrain/relay"
)

// commandConnectTimeout bounds how long a short-lived command (migrate,
// status, dead) waits for PostgreSQL to accept its connection, unless the
// URL sets connect_timeout: without it, a server whose host is gone can
// hold a connect for minutes of TCP retries.
const commandConnectTimeout = 10 * time.Second

// connectDB connects a short-lived command to PostgreSQL as the relay's own
// connections do: a bounded connect, and TCP keepalives (relay.KeepAlive)
// that notice a server gone in the middle of a command. appName, when not
// "", names the session unless the URL names it.
func connectDB(ctx context.Context, databaseURL, appName string) (*pgx.Conn, error) {
	cfg, err := pgx.ParseConfig(databaseURL)
	if err != nil {
		return nil, err
	}
	tuneCommandConn(cfg, appName)
	return pgx.ConnectConfig(ctx, cfg)
}

func tuneCommandConn(cfg *pgx.ConnConfig, appName string) {
	if cfg.ConnectTimeout == 0 {
		cfg.ConnectTimeout = commandConnectTimeout
	}
	cfg.DialFunc = (&net.Dialer{Timeout: cfg.ConnectTimeout, KeepAliveConfig: relay.KeepAlive()}).DialContext
	if appName != "" && cfg.RuntimeParams["application_name"] == "" {
		cfg.RuntimeParams["application_name"] = appName
	}
}
