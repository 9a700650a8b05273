package main

import (
	"testing"

	"github.com/stagedrain/stagedrain/relay/relaytest"
)

// The names chaos_test.go gives the private servers, from before
// relay/relaytest had them: thin adapters over relaytest.StartPostgres and
// relaytest.StartRedis, to delete once chaos_test.go calls those itself.

type privatePostgres struct {
	*relaytest.PostgresServer
	port int
}

func startPrivatePostgres(t *testing.T) *privatePostgres {
	t.Helper()
	s := relaytest.StartPostgres(t)
	return &privatePostgres{PostgresServer: s, port: s.Port}
}

func (s *privatePostgres) url() string { return s.URL() }
func (s *privatePostgres) start()      { s.Start() }
func (s *privatePostgres) stop()       { s.Stop() }

type stoppableRedis struct {
	*relaytest.RedisServer
	port int
}

func newStoppableRedis(t *testing.T, args ...string) *stoppableRedis {
	t.Helper()
	s := relaytest.StartRedis(t, args...)
	return &stoppableRedis{RedisServer: s, port: s.Port}
}

func (s *stoppableRedis) url() string { return s.URL() }
func (s *stoppableRedis) start()      { s.Start() }
func (s *stoppableRedis) stop()       { s.Stop() }
