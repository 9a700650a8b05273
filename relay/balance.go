package relay

// balancePlan is what one balance of a fleet's member does (see fleet.go):
// let go of release, or try the leader locks of try, in that order, and
// take at most want of them. At most one of release and try is set.
type balancePlan struct {
	share   int      // the most schemas this member may lead
	release []string // schemas led past the share, to let go
	try     []string // schemas nobody here leads, in the order to try
	want    int      // how many of try to take, at most
}

// planBalance is a fleet member's balance, a function of what it knows:
// members counts the fleet's members, this one among them (fewer than one
// counts as one); live counts the schemas found; leading are the schemas
// this member leads and has not let go, and idle those it does not lead
// and may try now (no backoff pending), each sorted by name; holder names
// this member.
//
// Each member leads at most its share, ceil(live / members). One that
// leads more lets the last ones go by name: the members agree on nothing
// else, and need not. One that leads fewer tries the idle schemas, each
// member starting at a place of its own (a hash of holder), so that
// members starting together do not all try the same schemas first.
func planBalance(members, live int, leading, idle []string, holder string) balancePlan {
	members = max(members, 1)
	p := balancePlan{share: (live + members - 1) / members}
	if len(leading) > p.share {
		p.release = leading[p.share:]
		return p
	}
	p.want = p.share - len(leading)
	if p.want == 0 || len(idle) == 0 {
		p.want = 0
		return p
	}
	off := int(hash(holder) % uint32(len(idle)))
	p.try = append(append(make([]string, 0, len(idle)), idle[off:]...), idle[:off]...)
	return p
}

// hash is FNV-1a of s.
func hash(s string) uint32 {
	h := uint32(2166136261)
	for i := 0; i < len(s); i++ {
		h = (h ^ uint32(s[i])) * 16777619
	}
	return h
}
