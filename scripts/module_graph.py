#!/usr/bin/env python3
"""The module graph of src/, read from its `use` lines and `crate::`/`super::` paths (test
modules and comments left out): prints the import cycles, the imports that run from a lower
layer to a higher one (LAYERS), then each module, whether it runs SQL (uses SPI), and what
it imports. Exits 1 when there is a cycle, an upward import, or a top-level module placed in
no layer; scripts/test.sh runs it.

Usage: python3 scripts/module_graph.py        (from the repository root)
"""
import os
import re
import sys

root = 'src'

# The layers of the top-level modules, lowest first: a module imports from its own layer or
# lower ones, never from a higher one (and modules of one layer import each other one way).
LAYERS = [
    # Pure rules and small foundations, with no import of the crate.
    ['allow_list', 'classify', 'clock', 'random', 'retry_policy', 'identity', 'config_cache',
     'pg_timeout', 'runtime'],
    # Errors and settings.
    ['error', 'gucs'],
    # How SQL runs, the workers' locks and shared memory, effect keys.
    ['spi', 'worker_locks', 'worker_slots', 'served_database', 'effect_key'],
    # Who acts: tenants and roles.
    ['tenancy'],
    # The queue and the ledger.
    ['outbox', 'ledger'],
    # The channels a message leaves by.
    ['channels'],
    # Lookups of uncertain messages.
    ['reconcile'],
    # The processes: the delivery workers and the metrics listener.
    ['worker', 'metrics'],
    # The extension's entry point.
    ['lib'],
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}
mods={}
for dp,dn,fn in os.walk(root):
    for f in fn:
        if not f.endswith('.rs'): continue
        p=os.path.join(dp,f)
        if '/tests/' in p: continue
        rel=p[4:-3]
        if rel.endswith('/mod'): rel=rel[:-4]
        mods[rel.replace('/','::')]=p
def resolve(cur, path):
    parts=path.split('::')
    if parts[0]=='crate': base=[]; parts=parts[1:]
    elif parts[0]=='super':
        base=cur.split('::')
        is_mod=mods[cur].endswith('mod.rs') or cur=='lib'
        base=base[:-1]; parts=parts[1:]
        while parts and parts[0]=='super': base=base[:-1]; parts=parts[1:]
    elif parts[0]=='self':
        base=cur.split('::') ; parts=parts[1:]
    else: return None
    # find longest prefix that's a module
    for i in range(len(parts),0,-1):
        m='::'.join(base+parts[:i])
        if m in mods: return m
    return None
deps={m:set() for m in mods}
spi={}
for m,p in mods.items():
    src=re.sub(r'//[^\n]*','',open(p).read())
    # strip test modules
    # (the test module only: a single item under #[cfg(test)] elsewhere stays)
    src=re.split(r'#\[cfg\((?:test|any\(test, feature = "pg_test"\))\)\]\s*(?:pub\s+)?mod\s+\w+\s*\{',src)[0]
    src=re.sub(r'#\[cfg\(test\)\]\s*use[^;]+;','',src)
    spi[m]=bool(re.search(r'\bSpi\b|spi::|SpiClient|SPI_',src))
    for u in re.findall(r'use\s+([^;]+);',src):
        u=re.sub(r'\s+','',u)
        # expand braces one level
        mm=re.match(r'(.*?)::\{(.*)\}$',u)
        items=[u]
        if mm:
            pre=mm.group(1); inner=mm.group(2)
            depth=0;cur='';items=[]
            for ch in inner:
                if ch=='{':depth+=1
                if ch=='}':depth-=1
                if ch==',' and depth==0: items.append(pre+'::'+cur);cur=''
                else: cur+=ch
            if cur: items.append(pre+'::'+cur)
        for it in items:
            it=it.split('::{')[0]
            r=resolve(m,it)
            if r and r!=m: deps[m].add(r)
    for it in re.findall(r'\b((?:crate|super)(?:::[a-z_]+)+)',src):
        r=resolve(m,it)
        if r and r!=m and not m.startswith(r+'::') : deps[m].add(r)
# cycles (SCC)
idx={};low={};st=[];on=set();sccs=[];c=[0]
sys.setrecursionlimit(10000)
def sc(v):
    idx[v]=low[v]=c[0];c[0]+=1;st.append(v);on.add(v)
    for w in deps[v]:
        if w not in idx: sc(w);low[v]=min(low[v],low[w])
        elif w in on: low[v]=min(low[v],idx[w])
    if low[v]==idx[v]:
        comp=[]
        while True:
            w=st.pop();on.discard(w);comp.append(w)
            if w==v:break
        if len(comp)>1: sccs.append(comp)
for v in deps:
    if v not in idx: sc(v)
print("cycles:", sccs if sccs else "none")
top = lambda m: m.split('::')[0]
unplaced = sorted({top(m) for m in mods if top(m) not in RANK})
upward = sorted(
    f"{m} -> {d} (layer {RANK[top(m)]} imports layer {RANK[top(d)]})"
    for m in deps for d in deps[m]
    if top(m) in RANK and top(d) in RANK and RANK[top(d)] > RANK[top(m)]
)
# Top-level modules that import each other (a cycle between two rooms of one layer).
pairs = {(top(m), top(d)) for m in deps for d in deps[m] if top(m) != top(d)}
mutual = sorted(f"{a} <-> {b}" for a, b in pairs if (b, a) in pairs and a < b)
print("not in a layer:", unplaced if unplaced else "none")
print("upward imports:", upward if upward else "none")
print("top-level modules importing each other:", mutual if mutual else "none")
for m in sorted(deps):
    print(f"{m:28} spi={int(spi[m])} -> {' '.join(sorted(deps[m]))}")
sys.exit(1 if sccs or unplaced or upward or mutual else 0)
