#!/usr/bin/env python3
"""The module graph of src/, read from its `use` lines and `crate::`/`super::` paths (test
modules and comments left out): prints the import cycles (none expected), then each module,
whether it runs SQL (uses SPI), and what it imports.

Usage: python3 scripts/module_graph.py        (from the repository root)
"""
import os
import re
import sys

root = 'src'
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
    src=re.split(r'#\[cfg\(test\)\]|#\[cfg\(any\(test, feature = "pg_test"\)\)\]',src)[0]
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
for m in sorted(deps):
    print(f"{m:28} spi={int(spi[m])} -> {' '.join(sorted(deps[m]))}")
