package relay

import (
	"fmt"
	"hash/fnv"
	"slices"
	"testing"
)

func TestPlanBalance(t *testing.T) {
	abc, abcd := []string{"a", "b", "c"}, []string{"a", "b", "c", "d"}
	for _, tc := range []struct {
		name           string
		members, live  int
		leading, idle  []string
		holder         string
		share, want    int
		release, tries []string
	}{
		{name: "alone, it takes every schema", members: 1, live: 3, idle: abc, holder: "m3",
			share: 3, want: 3, tries: []string{"b", "c", "a"}},
		{name: "no member counted is one member", members: 0, live: 3, idle: abc, holder: "m1",
			share: 3, want: 3, tries: abc},
		{name: "a tie rounds the share up", members: 2, live: 3, idle: abc, holder: "m1",
			share: 2, want: 2, tries: abc},
		{name: "at its share it does nothing", members: 2, live: 4, leading: []string{"a", "b"}, holder: "m1",
			share: 2},
		{name: "at its share it tries no idle schema", members: 2, live: 4, leading: []string{"a", "b"}, idle: []string{"c"}, holder: "m1",
			share: 2},
		{name: "a member joins: the last ones by name go", members: 2, live: 4, leading: abcd, holder: "m1",
			share: 2, release: []string{"c", "d"}},
		{name: "a third member joins a tied fleet: the second keeps its share", members: 3, live: 4, leading: []string{"a", "b"}, holder: "m1",
			share: 2},
		{name: "a third member joins: one goes", members: 3, live: 5, leading: abc, idle: []string{"d"}, holder: "m1",
			share: 2, release: []string{"c"}},
		{name: "a member leaves: the rest take its share", members: 1, live: 4, leading: []string{"a", "b"}, idle: []string{"c", "d"}, holder: "m2",
			share: 4, want: 2, tries: []string{"c", "d"}},
		{name: "a member leaves: another holder starts elsewhere", members: 1, live: 4, leading: []string{"a", "b"}, idle: []string{"c", "d"}, holder: "m1",
			share: 4, want: 2, tries: []string{"d", "c"}},
		{name: "hash placement m2", members: 2, live: 4, idle: abcd, holder: "m2",
			share: 2, want: 2, tries: []string{"c", "d", "a", "b"}},
		{name: "hash placement m3", members: 2, live: 4, idle: abcd, holder: "m3",
			share: 2, want: 2, tries: []string{"b", "c", "d", "a"}},
		{name: "more members than schemas", members: 5, live: 2, idle: []string{"a", "b"}, holder: "m1",
			share: 1, want: 1, tries: []string{"b", "a"}},
		{name: "no schema", members: 1, live: 0, holder: "m1"},
		{name: "below its share, nothing it may try (backoff)", members: 1, live: 3, leading: []string{"a"}, holder: "m1",
			share: 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := planBalance(tc.members, tc.live, tc.leading, tc.idle, tc.holder)
			want := balancePlan{share: tc.share, release: tc.release, try: tc.tries, want: tc.want}
			if fmt.Sprint(got) != fmt.Sprint(want) {
				t.Fatalf("planBalance(%d, %d, %q, %q, %q) = %+v, want %+v",
					tc.members, tc.live, tc.leading, tc.idle, tc.holder, got, want)
			}
		})
	}
}

// The tries start at FNV-1a of the holder (the table's rotations depend on
// it): the standard library's, byte for byte.
func TestBalanceHashIsFNV1a(t *testing.T) {
	for _, s := range []string{"", "m1", "m2", "stagedrain-leader-1", "ünïcode"} {
		h := fnv.New32a()
		h.Write([]byte(s))
		if got, want := hash(s), h.Sum32(); got != want {
			t.Errorf("hash(%q) = %d, want %d", s, got, want)
		}
	}
}

// balanceSim is a fleet run on planBalance alone: each member, in turn,
// counts the members, plans, lets go or tries the locks (a schema led by
// another member fails its try), until no member changes anything.
type balanceSim struct {
	schemas []string
	leader  map[string]string // schema -> member leading it
	// released are the schemas a member let go in its last turn, which
	// it does not try again right away (fleetSession.after's retryAt).
	released map[string][]string
}

func (b *balanceSim) turn(me string, members int) (changed bool) {
	var leading, idle []string
	for _, s := range b.schemas {
		switch {
		case b.leader[s] == me:
			leading = append(leading, s)
		case !slices.Contains(b.released[me], s):
			idle = append(idle, s)
		}
	}
	b.released[me] = nil
	p := planBalance(members, len(b.schemas), leading, idle, me)
	for _, s := range p.release {
		delete(b.leader, s)
		b.released[me] = append(b.released[me], s)
		changed = true
	}
	took := 0
	for _, s := range p.try {
		if took == p.want {
			break
		}
		if b.leader[s] == "" {
			b.leader[s] = me
			took++
			changed = true
		}
	}
	return changed
}

// settle runs turns until a whole round, twice over, changes nothing, and
// checks that every schema is led, by a member within its share.
func (b *balanceSim) settle(t *testing.T, members []string) {
	t.Helper()
	quiet := 0
	for round := 0; quiet < 2; round++ {
		if round > 20 {
			t.Fatalf("%d members, %d schemas: no balance after 20 rounds: %v", len(members), len(b.schemas), b.leader)
		}
		changed := false
		for _, m := range members {
			changed = b.turn(m, len(members)) || changed
		}
		if changed {
			quiet = 0
		} else {
			quiet++
		}
	}
	share := (len(b.schemas) + len(members) - 1) / max(len(members), 1)
	count := map[string]int{}
	for _, s := range b.schemas {
		m := b.leader[s]
		if !slices.Contains(members, m) {
			t.Fatalf("%d members, %d schemas: schema %s led by %q, not a member: %v", len(members), len(b.schemas), s, m, b.leader)
		}
		count[m]++
	}
	for m, n := range count {
		if n > share {
			t.Fatalf("%d members, %d schemas: %s leads %d, past its share %d: %v", len(members), len(b.schemas), m, n, share, b.leader)
		}
	}
}

// Members that join one at a time, then leave one at a time, settle each
// time with every schema led and none past its share; and a settled fleet
// stays as it is (settle's quiet rounds).
func TestPlanBalanceSettles(t *testing.T) {
	for n := 0; n <= 9; n++ {
		b := &balanceSim{leader: map[string]string{}, released: map[string][]string{}}
		for i := range n {
			b.schemas = append(b.schemas, fmt.Sprintf("t_%02d", i))
		}
		var members []string
		for i := 1; i <= 4; i++ { // join
			members = append(members, fmt.Sprintf("m%d", i))
			b.settle(t, members)
		}
		for len(members) > 1 { // leave: its locks go with its connection
			gone := members[0]
			members = members[1:]
			for s, m := range b.leader {
				if m == gone {
					delete(b.leader, s)
				}
			}
			b.settle(t, members)
		}
	}
}
