package bench

import (
	"context"
	"fmt"
	"time"
)

// benchFleetLatency measures, for each of --app-cost-schemas, one relay
// --schemas over that many schemas, alone on the machine (no twin relay,
// no TPS rounds before it): the latency at 100 and 1,000 jobs/s spread over
// the schemas, against the single-schema targets of the latency scenario.
// app-cost measures the same rows after its TPS rounds, beside a twin
// relay; this one is short enough to run again and again.
//
// The targets are absolute, and a machine half as fast as the README's
// misses them with one schema too (p50 1.16ms at 100 jobs/s on such a
// machine): so a relay of one schema runs the same two rates first, in the
// same sitting, and the fleets' rows read against it.
func (b *bench) benchFleetLatency(ctx context.Context) error {
	p, err := b.freshRelay(ctx)
	if err != nil {
		return err
	}
	for _, rate := range []int{100, 1000} {
		row, err := b.latency(ctx, p, latencyCase{rate: rate, writers: 4,
			p50: time.Millisecond, p99: 5 * time.Millisecond})
		if err != nil {
			return err
		}
		row.scenario = "one schema, for reference: " + row.scenario
		b.rows = append(b.rows, row)
	}
	if _, err := b.stopRelay(); err != nil {
		return err
	}
	for _, n := range b.cfg.AppCostSchemas {
		schemas := b.tenantSchemas("f", n)
		if err := b.migrateTenants(ctx, schemas); err != nil {
			return err
		}
		tables := b.tenantTables(schemas)
		conn, err := b.connect(ctx)
		if err != nil {
			return err
		}
		err = b.resetTables(ctx, conn, tables)
		conn.Close(context.WithoutCancel(ctx))
		if err != nil {
			return err
		}
		p, err := b.startRelayOn(false, "--schemas", b.tenantPattern("f"))
		if err != nil {
			return err
		}
		if err := b.probeAll(ctx, p, tables); err != nil {
			return err
		}
		if err := b.waitReadyOn(ctx, p, true, tables); err != nil {
			return err
		}
		// Twice: from the relay's start, as a deploy under load sees it,
		// then again once each of its sessions has planned each schema's
		// statements (over 200 schemas and 4 pool sessions, the first 8s
		// at 100 jobs/s are 4 jobs a schema), as it runs from then on.
		for _, pass := range []string{"fleet alone", "fleet alone, again"} {
			for _, rate := range []int{100, 1000} {
				row, err := b.latency(ctx, p, latencyCase{rate: rate, writers: 4,
					p50: time.Millisecond, p99: 5 * time.Millisecond, tables: tables})
				if err != nil {
					return err
				}
				row.scenario = fmt.Sprintf("%s: %s", pass, row.scenario)
				b.rows = append(b.rows, row)
			}
		}
		if _, err := b.stopRelay(); err != nil {
			return err
		}
	}
	return nil
}
