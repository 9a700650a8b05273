package relay

import (
	"context"
	"fmt"
	"slices"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// The fleet's poll finds the schemas with rows staged, in one statement
// that PostgreSQL plans once: prepared on the pool's session, and built
// again only when the schemas led change. Planning a union over 200
// schemas took 13.8 ms a poll where running it prepared takes 1.8 ms, and
// a hot fleet polls hundreds of times a second. Its hot polls list the
// schemas led in one order: in a map's, each poll was a new statement.
func TestFleetPollIsPrepared(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testenv.DatabaseURL()
	base := testenv.Name("fpoll")
	conn := testenv.Conn(t, url)
	var led []*tenant
	rdb, ns := testenv.Redis(t)
	r, err := New(Config{DatabaseURL: url, Redis: rdb, RedisNamespace: ns, Schemas: []string{base + "_*"}})
	if err != nil {
		t.Fatal(err)
	}
	for _, suffix := range []string{"a", "b", "c"} {
		schema := testenv.SchemaNamedIn(t, url, base+"_"+suffix)
		if _, err := Migrate(ctx, conn, schema); err != nil {
			t.Fatal(err)
		}
		led = append(led, &tenant{schema: schema, r: r, wake: make(chan struct{}, 1)})
	}
	if _, err := NewStager(led[1].schema).Stage(ctx, conn, Job{Name: "W"}); err != nil {
		t.Fatal(err)
	}
	pcfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	pcfg.MaxConns = 1 // the poll's session is the one the test reads
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	s := &fleetSession{f: r.fleet, pool: pool}

	woken := func() (names []string) {
		for _, l := range led {
			select {
			case <-l.wake:
				names = append(names, l.schema)
			default:
			}
		}
		return names
	}
	for range 3 {
		if n := s.poll(ctx, led, true); n != 1 {
			t.Fatalf("the poll found %d schemas with rows, want 1 (%s)", n, led[1].schema)
		}
		if got := woken(); !slices.Equal(got, []string{led[1].schema}) {
			t.Fatalf("the poll woke %v, want %s only", got, led[1].schema)
		}
	}
	first := s.pollSQL[0]
	s.poll(ctx, led[:2], true)
	if s.pollSQL[0] == first {
		t.Fatal("the poll's statement was not rebuilt for other schemas led")
	}
	second := s.pollSQL[0]
	woken()

	// The session's own list of the schemas it leads, as its hot polls
	// take it: the same statement every time (a map's order changes at
	// every range).
	for _, l := range led {
		l.leading = true
		r.fleet.tenants[l.schema] = l
	}
	for range 20 {
		s.poll(ctx, s.led(), true)
		woken()
	}
	if len(s.pollSQL) != 1 || s.pollSQL[0] != first {
		t.Fatalf("the poll over every schema led is %q, want %q (the schemas in order)", s.pollSQL, first)
	}

	c, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Release()
	rows, err := c.Query(ctx, `SELECT statement FROM pg_prepared_statements WHERE statement LIKE 'SELECT 0 FROM (SELECT FROM %'`)
	if err != nil {
		t.Fatal(err)
	}
	prepared, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	// One statement per set of schemas led, each prepared once for all its
	// polls.
	if !slices.Contains(prepared, first) || !slices.Contains(prepared, second) || len(prepared) != 2 {
		t.Fatalf("prepared on the poll's session: %q; want the statements of both sets of schemas led, once each", prepared)
	}
}

// The poll over more schemas than a statement holds (pollChunk) sends a
// statement per chunk in one round trip, each planned again alone when one
// of its tables changes, and finds the rows of every chunk: here of the
// first schema and of two past the first chunk.
func TestFleetPollChunks(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testenv.DatabaseURL()
	base := testenv.Name("fchunk")
	conn := testenv.Conn(t, url)
	rdb, ns := testenv.Redis(t)
	r, err := New(Config{DatabaseURL: url, Redis: rdb, RedisNamespace: ns, Schemas: []string{base + "_*"}})
	if err != nil {
		t.Fatal(err)
	}
	var led []*tenant
	for i := range 2*pollChunk + 3 {
		schema := testenv.SchemaNamedIn(t, url, fmt.Sprintf("%s_%02d", base, i))
		if _, err := Migrate(ctx, conn, schema); err != nil {
			t.Fatal(err)
		}
		led = append(led, &tenant{schema: schema, r: r, wake: make(chan struct{}, 1)})
	}
	want := []string{led[0].schema, led[pollChunk+1].schema, led[2*pollChunk+2].schema}
	for _, schema := range want {
		if _, err := NewStager(schema).Stage(ctx, conn, Job{Name: "W"}); err != nil {
			t.Fatal(err)
		}
	}
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	s := &fleetSession{f: r.fleet, pool: pool}
	if n := s.poll(ctx, led, false); n != len(want) {
		t.Fatalf("the poll found %d schemas with rows, want %d (%v)", n, len(want), want)
	}
	if len(s.pollSQL) != 3 {
		t.Fatalf("the poll over %d schemas is %d statements, want 3 of %d at most", len(led), len(s.pollSQL), pollChunk)
	}
	var woken []string
	for _, l := range led {
		select {
		case <-l.wake:
			woken = append(woken, l.schema)
		default:
		}
	}
	if !slices.Equal(woken, want) {
		t.Fatalf("the poll woke %v, want %v", woken, want)
	}
}
